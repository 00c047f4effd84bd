"""``sidecar demo``: a mock Dynamo-style gateway and a multi-turn workload, run directly and
through the sidecar, compared side by side."""

from sidecar.demo.runner import DemoResult, run_demo

__all__ = ["DemoResult", "run_demo"]

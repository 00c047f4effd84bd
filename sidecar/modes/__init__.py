"""Routing modes: one plugin per gateway family (see :mod:`sidecar.modes.base` for the contract)."""

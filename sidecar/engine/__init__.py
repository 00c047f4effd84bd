"""HTTP engines: they move bytes and ask the router what to change, nothing else. The contract is
:mod:`sidecar.engine.base`; :mod:`sidecar.engine.fast` is the default, protocol-level engine,
:mod:`sidecar.engine.aiohttp_engine` the reference one."""

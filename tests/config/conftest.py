"""Every configuration test lives here: settings, early refusals, the JSON schema, deployments, TLS."""

from tests.tls.conftest import pki  # noqa: F401  (the TLS settings tests read real certificate files)

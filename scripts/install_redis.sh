#!/usr/bin/env bash
# Install what the shared-store tests need: Debian's redis-server (and redis-cli). The tests start
# their own servers on free loopback ports; the system service is not started (a policy-rc.d for
# the install) nor used. Idempotent; needs root for apt-get (as CI has).
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "install_redis.sh: redis-server is missing and installing it needs root (apt-get install redis-server)" >&2
  exit 1
fi
echo "installing redis-server with apt-get"
policy=/usr/sbin/policy-rc.d
created=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created=1
fi
trap '[[ $created == 1 ]] && rm -f "$policy"' EXIT
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
redis-server --version

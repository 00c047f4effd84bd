"""What scripts/test.sh installs is what the README says it installs: each installer it runs has
a row in the README's table saying where it installs, whether it needs apt-get (system packages,
root), and whether `--quick` runs it too."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_SH = (ROOT / "scripts" / "test.sh").read_text()
README = (ROOT / "README.md").read_text()
# Each installer and the words of its README row (add one when test.sh runs a new installer).
ROWS = {
    "install_redis.sh": "`redis-server`",
    "install_gateways.sh": "`.gateways/`",
    "install_deploy_tools.sh": "`.tools/`",
    "install_browser.sh": "Chromium",
    "install_agents.sh": "`.agents/`",
}


def test_every_installer_test_sh_runs_is_in_the_readme() -> None:
    quick_part, _, full_part = TEST_SH.partition("if [[ $quick == 0 ]]")
    run = {name: "always" for name in re.findall(r"\./scripts/(install_\w+\.sh)", quick_part)}
    run |= {name: "full run" for name in re.findall(r"\./scripts/(install_\w+\.sh)", full_part) if name not in run}
    assert set(run) == set(ROWS), "document the installer in README.md and in ROWS"
    table = [line for line in README.splitlines() if line.startswith("| ")]
    for name, when in run.items():
        (row,) = [line for line in table if ROWS[name] in line]
        cells = [c.strip() for c in row.strip("|").split("|")]
        apt = "apt-get" in (ROOT / "scripts" / name).read_text()
        assert ("apt-get" in cells[1]) is apt, (name, row)
        assert cells[2].startswith(when), (name, row)
    assert "| the package and its test dependencies | `.venv` (pip) | always |" in table

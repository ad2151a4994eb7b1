"""Every ``bash benchmarks/device.sh PHASE`` the docs, the README and the
benchmarks print is a phase ``device.sh`` runs, so a command copied from them
onto the GPU machine does what it says (an unknown phase falls through the
script's ``case`` and does nothing)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def phases() -> set:
    script = (ROOT / "benchmarks" / "device.sh").read_text()
    return set(re.findall(r"^([a-z0-9]+)\)$", script, flags=re.M))


def test_every_device_command_the_docs_print_is_a_phase():
    named = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "benchmarks" / "device.sh"]:
        for phase in re.findall(r"device\.sh\s+([a-z0-9]+)", path.read_text()):
            named.setdefault(phase, path.name)
    known = phases()
    assert {"suite", "serve32", "buffers"} <= known  # the parse finds the phases
    assert named, "no device.sh command found"
    assert {p: f for p, f in named.items() if p not in known} == {}

"""Every flag explained: each option of each command has help with its default, README's `pdserve up`
table is what `pdserve flags up` prints from the parser, and README's worker table names exactly the
workers' flags."""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

import pytest

from pdserve.cli import HelpFormatter, _subcommands, build_parser, flag_table

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subs = _subcommands(parser)
    return {"pdserve": parser, **{f"pdserve {n}": p for n, p in subs.items()},
            **{f"pdserve bench {n}": p for n, p in _subcommands(subs["bench"]).items()}}


@pytest.mark.parametrize("name", list(commands()))
def test_every_flag_has_help_and_shows_its_default(name):
    parser = commands()[name]
    assert parser.formatter_class is HelpFormatter
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        default = action.default
        if isinstance(default, (int, float, str)) and not isinstance(default, bool) and default != "":
            assert "default" in formatter._get_help_string(action), \
                f"{name} {action.option_strings[0]}: --help does not say its default {default!r}"
    text = parser.format_help()
    if name == "pdserve up":  # what a user reads
        assert "the router's HTTP port (default 8000)" in " ".join(text.split())


def test_readme_up_table_is_generated_from_the_parser():
    block = re.search(r"<!-- pdserve flags up -->\n(.*?)<!-- end pdserve flags up -->", README, re.S)
    assert block, "README.md lost its generated `pdserve up` table"
    assert block.group(1) == flag_table(_subcommands(build_parser())["up"]), \
        "README's `pdserve up` table is stale: paste `pdserve flags up` between its markers"


def test_readme_worker_table_names_exactly_the_workers_flags():
    table = README.split("Worker flags:", 1)[1].split("\n\n", 2)[1]
    first_column = "\n".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| `"))
    documented = set(re.findall(r"`(--[a-z0-9-]+)`", first_column))
    worker = _subcommands(build_parser())["decode"]
    flags = {o for a in worker._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert flags - documented == set(), f"worker flags missing from README's table: {sorted(flags - documented)}"
    assert documented - flags == set(), f"README's worker table names flags workers lack: {sorted(documented - flags)}"


def test_pdserve_flags_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "pdserve", "flags", "router"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("| flag | meaning |") and "`--zmq-host`" in out and "(default 8000)" in out

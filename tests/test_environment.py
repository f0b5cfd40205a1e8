"""Every environment variable read under dsflash/ is listed, with its reason, in dsflash/environment.py."""
import os
import re

from dsflash import environment

ROOT = os.path.join(os.path.dirname(__file__), "..", "dsflash")
READ = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\.setdefault)\(\s*["']([A-Z0-9_]+)["']"""
                  r"""|os\.environ\[\s*["']([A-Z0-9_]+)["']\s*\]""")


def _reads():
    found = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                for m in READ.finditer(open(p, encoding="utf-8").read()):
                    found.setdefault(m.group(1) or m.group(2), set()).add(os.path.relpath(p, os.path.dirname(ROOT)))
    return found


def test_every_variable_read_is_listed():
    reads = _reads()
    assert "DSFLASH_API_KEY" in reads                      # the scan sees the package's reads at all
    missing = sorted(set(reads) - set(environment.VARIABLES))
    assert not missing, f"environment variables read but not listed in dsflash/environment.py: {missing}"
    for name, files in reads.items():
        assert environment.VARIABLES[name][1] in files, (name, files)


def test_listed_kinds():
    kinds = {"secret", "foreign", "transitional", "default", "tooling", "test"}
    assert all(v[0] in kinds and v[2] for v in environment.VARIABLES.values())

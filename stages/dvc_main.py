"""`python stages/dvc_main.py <dvc arguments>`: DVC's command line, with its YAML work done once.

DVC (3.x) updates dvc.lock after every stage it runs by parsing the whole file in ruamel.yaml's
round-trip mode and emitting it again, pure-Python YAML work that grows with the pipeline, not the
stage: ~0.8 s a stage for the demo's 62 KB lock, ~2.6 s for llm/'s 141 KB, most of what DVC itself
spends in a small project's `dvc repro`. The lock is a `stages:` mapping whose entries are emitted
independently of one another, so emitting only the updated stage's entry (with DVC's own emitter)
and putting it in place of the old one's text gives the very bytes DVC writes
(tests/test_dvc_main.py compares them). A lock not in that form (comments, blank lines, other
top-level keys after `stages:`) is left to DVC's own code.

DVC also parses params.yaml once for every stage that reads params (87 times in one `dvc status` of
mpnet/, with compare/), and the lock several times (ruamel.yaml's safe mode: parsed in C with
ruamel.yaml.clib, built into Python objects in Python): a file's parse is kept for its text here
(`parse_yaml_once`), and each caller gets its own copy.

`make repro`, `make exp` and the tests run DVC this way (stages/with_warm_stages.py,
tests/dvc_served.py); a plain `dvc repro` writes the same file, the usual way.
"""

from __future__ import annotations

import copy
import io
import logging
import sys
from typing import Any, Callable, Iterable, Mapping

logger = logging.getLogger("dvc.dvcfile")


def stage_entry(name_and_data: Mapping) -> str:
    """The text of one `stages:` entry ({name: lock data}) as DVC's emitter writes it in dvc.lock."""
    from dvc.utils.serialize._yaml import _dump

    out = io.StringIO()
    _dump({"stages": dict(name_and_data)}, out)
    text = out.getvalue()
    if not text.startswith("stages:\n"):
        raise ValueError("unexpected emitter output")
    return text[len("stages:\n"):]


def split_lock(text: str) -> tuple[str, list[str]] | None:
    """(the text up to and including `stages:`, each stage's entry text), or None when the lock is
    not a header of top-level keys followed by the `stages:` mapping and nothing else."""
    lines = text.splitlines(keepends=True)
    if not text.endswith("\n") or "stages:\n" not in lines:
        return None
    at = lines.index("stages:\n") + 1
    head, body = lines[:at], lines[at:]
    if any(not line.strip() or line.startswith((" ", "#")) for line in head):
        return None
    entries: list[list[str]] = []
    for line in body:
        if not line.startswith("  ") or not line.strip() or line.lstrip().startswith("#"):
            return None   # a blank line, a comment or a top-level key after the stages
        if line[2] != " ":
            entries.append([line])
        elif not entries:
            return None
        else:
            entries[-1].append(line)
    return "".join(head), ["".join(e) for e in entries]


def spliced(text: str, updates: Iterable[Mapping]) -> tuple[str, bool] | None:
    """`text` with each update ({stage name: lock data}) in place of that stage's entry, or after the
    last one for a new stage, and whether anything changed; None when `split_lock` cannot split it."""
    parts = split_lock(text)
    if parts is None:
        return None
    head, entries = parts
    changed = False
    for update in updates:
        for name, data in update.items():
            entry = stage_entry({name: data})
            key = entry.splitlines(keepends=True)[0]
            where = next((i for i, e in enumerate(entries) if e.splitlines(keepends=True)[0] == key), None)
            if where is None:
                entries.append(entry)
            elif entries[where] != entry:
                entries[where] = entry
            else:
                continue
            changed = True
    return head + "".join(entries), changed


def parse_yaml_once(parse: Callable[..., Any]) -> Callable[..., Any]:
    """DVC's `parse_yaml(text, path, typ)` with each text's safe-mode parse kept (a round-trip parse,
    whose result DVC edits and writes back, is not): a copy of it for every caller, which may change it."""
    parsed: dict[str, Any] = {}

    def parse_yaml(text, path, typ="safe"):
        if typ != "safe":
            return parse(text, path, typ=typ)
        if text not in parsed:
            parsed[text] = parse(text, path, typ=typ)   # an error is raised, and nothing kept
        return copy.deepcopy(parsed[text])

    parse_yaml.once = True
    return parse_yaml


def install() -> None:
    """Make DVC's `Lockfile.dump_stages` splice the updated entries into the lock's text (its own
    code stays the fallback for a new, empty or unusual lock), and its YAML parses `parse_yaml_once`."""
    import dvc.utils.serialize
    import dvc.utils.strictyaml
    from dvc.dvcfile import Lockfile
    from dvc.stage import serialize
    from dvc.utils.serialize import _yaml

    original = Lockfile.dump_stages
    if getattr(original, "spliced", False):
        return
    once = parse_yaml_once(_yaml.parse_yaml)
    for module in (_yaml, dvc.utils.serialize, dvc.utils.strictyaml):   # each holds its own name for it
        module.parse_yaml = once

    def dump_stages(self, stages, **kwargs):
        if not stages:
            return
        fs = self.repo.fs
        text = None
        if fs.exists(self.path):
            with fs.open(self.path, encoding="utf-8") as fd:
                text = fd.read()
        result = spliced(text, [serialize.to_lockfile(s, **kwargs) for s in stages]) if text else None
        if result is None:
            return original(self, stages, **kwargs)
        new_text, changed = result
        if changed:
            logger.info("Updating lock file '%s'", self.relpath)
            with fs.open(self.path, "w+", encoding="utf-8") as fd:
                fd.write(new_text)
            self.repo.scm_context.track_file(self.relpath)

    dump_stages.spliced = True
    Lockfile.dump_stages = dump_stages


def run(argv: list[str]) -> int:
    """DVC's command line on `argv`, with `install`'s lock writes."""
    install()
    from dvc.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

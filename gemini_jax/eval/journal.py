"""A long grid's finished cells on disk, so that an interrupted run continues where it stopped.

A grid of hours (the RULER-style grid on a pretrained model, say) writes each cell as soon as it is
measured, one JSON line appended and flushed to `<name>.partial.jsonl` beside its record. A run of
the same grid finds the file, checks that it was written for the same settings, and measures only
the cells it lacks; the finished record then says which cells came from an earlier run and at which
commit each was measured. The file goes away once the record is written.

    journal = CellJournal(path, fingerprint)     # ConfigError: the file holds another grid
    cell = journal.get(key)                      # None: not measured yet
    journal.add(key, {"cell": ..., "records": [...]})
    journal.close()                              # the record is written: remove the file

Line 1 is the header, {"fingerprint": ..., "started": date}; each later line is one cell, {"key",
"commit", "date", "payload"}. A last line cut short by a kill (no newline, or not JSON) is dropped
and that cell is measured again; a damaged line before it is refused by name.
"""

from __future__ import annotations

import json
import os

from gemini_jax.errors import ConfigError
from gemini_jax.eval.record import git_commit, utc_now


def _key(key) -> str:
    return json.dumps(list(key) if isinstance(key, (tuple, list)) else [key])


class CellJournal:
    """The cells of one grid measured so far (see the module docstring)."""

    def __init__(self, path: str, fingerprint: dict, *, resume: bool = True):
        self.path = path
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as it reads back
        self._cells: dict[str, dict] = {}
        if resume and os.path.exists(path):
            self._read()
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as fh:
                fh.write(json.dumps({"fingerprint": self.fingerprint, "started": utc_now()}) + "\n")
        self.resumed = len(self._cells)  # cells an earlier run measured

    def _read(self) -> None:
        with open(self.path) as fh:
            text = fh.read()
        lines = text.split("\n")
        complete, tail = lines[:-1], lines[-1]  # a file ends with "\n": tail is "" unless cut short
        try:
            header = json.loads(complete[0]) if complete else None
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or "fingerprint" not in header:
            raise ConfigError(f"{self.path} is not a grid journal (its first line is not a header); remove it to "
                              f"start the grid afresh.")
        if header["fingerprint"] != self.fingerprint:
            old, new = header["fingerprint"], self.fingerprint
            differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ConfigError(f"{self.path} holds cells of a grid with other settings ({', '.join(differ)} differ); "
                              f"run with those settings to continue it, or with resume=false to start afresh.")
        for n, line in enumerate(complete[1:], 2):
            try:
                entry = json.loads(line)
                self._cells[entry["key"]] = entry
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{self.path} line {n} is damaged; remove that line (its cell is measured "
                                  f"again) or the file (the grid starts afresh).") from None
        if tail:  # written up to a kill: that cell is measured again
            with open(self.path, "w") as fh:
                fh.write("\n".join(complete) + "\n")

    def get(self, key):
        """The payload stored for `key`, or None."""
        entry = self._cells.get(_key(key))
        return None if entry is None else entry["payload"]

    def add(self, key, payload: dict) -> None:
        """Store one finished cell (appended and flushed to disk before returning)."""
        entry = {"key": _key(key), "commit": git_commit(), "date": utc_now(), "payload": payload}
        line = json.dumps(entry, default=float)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._cells[entry["key"]] = json.loads(line)

    def commits(self) -> dict[str, int]:
        """commit -> how many of the stored cells were measured at it."""
        out: dict[str, int] = {}
        for entry in self._cells.values():
            out[str(entry["commit"])] = out.get(str(entry["commit"]), 0) + 1
        return out

    def close(self) -> None:
        """The grid's record is written: the journal has served."""
        if os.path.exists(self.path):
            os.remove(self.path)

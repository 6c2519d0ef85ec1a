"""``kilolayer train`` that pauses before one step, for tests that act on a process mid-run.

    python tests/train_harness.py GATE_DIR AT kilolayer-arguments...

Just before computing step AT + 1 (with AT = -1: while loading its data, during set-up) it writes
GATE_DIR/waiting (holding its PID) and waits until GATE_DIR/go exists, then trains on exactly as
``kilolayer`` would (the batches are the same).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    gate, at, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    import kilolayer.train.engine as loop

    load_source = loop.load_source

    def pause() -> None:
        (gate / "waiting").write_text(str(os.getpid()))
        while not (gate / "go").exists():
            time.sleep(0.01)

    def paused_source(config):
        if at < 0:
            pause()
        source = load_source(config)
        train_batch = source.train_batch

        def batch(index, *rest, **kw):
            if index == at:
                pause()
            return train_batch(index, *rest, **kw)

        source.train_batch = batch
        return source

    loop.load_source = paused_source
    from kilolayer.cli import main as kilolayer

    return kilolayer(args)


if __name__ == "__main__":
    raise SystemExit(main())

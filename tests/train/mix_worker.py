"""Run one apply of a YAML config (argv[1]) and log every micro-batch the engine gets to argv[2]
(JSON lines: micro-batch number, every rank's (source, row) draws, sha256 of rank 0's token ids);
argv[3]: --resume. Under torchrun only rank 0 logs.
Launched as a subprocess by tests/train/test_mixture_run.py (kill -9 and resume)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from apr.config import config_hash, load_config
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run


def main() -> int:
    config = load_config(Path(sys.argv[1])).config
    log = Path(sys.argv[2])
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    run = prepare_run(resolve_config(config, resume=resume), config_hash=config_hash(config),
                      config_path=Path(sys.argv[1]),
                      options=ApplyOptions(resume=resume, handle_signals=False))
    loader, draw = run.loader, run.loader.next_batch

    def logged():
        at = loader.absolute
        batch = draw()
        with log.open("a") as f:
            f.write(json.dumps({"micro_batch": at, "rows": loader.draws_at(at),
                                "sha": hashlib.sha256(batch.numpy().tobytes()).hexdigest()}) + "\n")
        return batch

    if run.is_main:  # rank 0 logs every rank's draws (the sha is of its own part)
        loader.next_batch = logged
    return run.execute().exit_code


if __name__ == "__main__":
    sys.exit(main())

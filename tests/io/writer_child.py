"""A writer process for the crash tests: writes steps 0..N-1 of deterministic output.

    python -m tests.io.writer_child BOOTSTRAP NAME OUTPUT_TOPIC STEPS [REPLAY [PACE]]

Like the runtime after a restart, it opens the writer, goes back ``REPLAY`` steps before the
step log's next step (replays: recognised, checked, discarded), and writes on. A step whose
transaction was aborted is rerun; a lost connection reopens the writer (whose step log says
where to go on). Prints ``step S`` after each written step, then idles ``PACE`` seconds (so
that a broker restart test finds it still writing). Exit 0 when done, 3 when fenced.
"""

from __future__ import annotations

import sys
import time

from sparkstep.io.config import KafkaConfig
from sparkstep.io.errors import (
    KafkaUnavailableError,
    ReplayMismatchError,
    StepAbortedError,
    StreamIOError,
    WriterFencedError,
)
from sparkstep.io.output import OutputOptions, OutputWriter, WriteOutcome

from .fixtures import step_facts, step_letters, step_table

DEPLOYMENT = "crash-test-deployment"


def main(argv: list[str]) -> int:
    bootstrap, name, output, steps = argv[0], argv[1], argv[2], int(argv[3])
    replay = int(argv[4]) if len(argv) > 4 else 2
    pace = float(argv[5]) if len(argv) > 5 else 0.0
    config = KafkaConfig(bootstrap, timeout_s=10.0)
    options = OutputOptions(
        name=name,
        deployment=DEPLOYMENT,
        output_topic=output,
        key_columns=("key",),
        create_output_topic=False,
    )
    while True:
        writer = OutputWriter(config, options)
        try:
            step = max(0, writer.open() - replay)
            while step < steps:
                try:
                    result = writer.write(
                        step, step_table(step, shuffle=True), step_letters(step), step_facts(step)
                    )
                except StepAbortedError as exc:
                    print(f"aborted {step}: {exc}", flush=True)
                    continue
                if result.outcome is WriteOutcome.WRITTEN:
                    print(f"step {step}", flush=True)
                    if pace:
                        time.sleep(pace)
                step += 1
            writer.close()
            return 0
        except WriterFencedError as exc:
            print(f"fenced: {exc}", flush=True)
            return 3
        except ReplayMismatchError:
            raise
        except (KafkaUnavailableError, StreamIOError) as exc:
            print(f"reopening after: {exc}", flush=True)
            writer.close()
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

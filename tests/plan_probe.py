"""Run under torchrun by test_dry_run.py: the real trainer, its second step measured as a dry run's plan
measures it, by other instruments: this process's resident memory (its peak during the step, above what it held
before its model was built), and the step's collectives counted over real tensors. Each rank writes
probe_rank{r}.json into the working folder.

Start the ranks with glibc's allocator returning freed blocks at once (MALLOC_MMAP_THRESHOLD_): otherwise
the memory a rank freed stays resident and its peak says more than its tensors held.
"""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402
from fsdp_gpt.observe.collectives import CountedCollectives  # noqa: E402
from fsdp_gpt.observe.profiling import Profiling  # noqa: E402

MEASURED_STEP = 2  # the first to begin with the optimizer's state, as the dry run's step does


def resident_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


figures = {}


def before_the_model(build_model):
    def built(*args, **kwargs):
        figures["baseline_kb"] = resident_kb("VmRSS")
        return build_model(*args, **kwargs)
    return built


class MeasuredStep(Profiling):
    """The loop's own hooks around a step (Profiling.begin, end): the measured step's peak and collectives."""

    def begin(self, step: int) -> None:
        super().begin(step)
        if step == MEASURED_STEP:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak from here on
            figures["step_start_kb"] = resident_kb("VmRSS")
            self.counted = CountedCollectives()
            self.counted.__enter__()

    def end(self, step: int) -> None:
        if step == MEASURED_STEP:
            self.counted.__exit__(None, None, None)
            figures["peak_kb"] = resident_kb("VmHWM")
            collectives = self.counted.collectives
            figures["collective_gb"] = collectives.by_kind()
            figures["calls"] = {kind: sum(n for (k, _), n in collectives.calls.items() if k == kind)
                                for kind, _ in collectives.calls}
        super().end(step)


def probe(argv: list[str]) -> None:
    train_fsdp.train(parse_args(argv))
    with open(f"probe_rank{dist.get_rank()}.json", "w") as f:
        json.dump(figures, f)


train_fsdp.build_model = before_the_model(train_fsdp.build_model)
train_fsdp.Profiling = MeasuredStep
run_entry_point(lambda: probe(sys.argv[1:]))

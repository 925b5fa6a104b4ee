"""Run by test_compile.py: the real trainer with compile on, in one process; prints, as JSON on its
last line, dynamo's graph breaks (counters["graph_break"]: reason -> count) and its recompiles (the
"Recompiling function ..." reports of its guards, with the guard that failed)."""
import json
import logging
import os
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from fsdp_gpt.config_parse import parse_args  # noqa: E402
from fsdp_gpt.distributed.launch import run_entry_point  # noqa: E402

recompiles = []


class Recompiles(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        if lines and lines[0].startswith("Recompiling function"):
            recompiles.append(" ".join(line.strip() for line in lines))


def probe(argv: list[str]) -> None:
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Recompiles())
    train_fsdp.train(parse_args(argv))
    print(json.dumps({"graph_breaks": dict(counters["graph_break"]), "recompiles": recompiles}))


run_entry_point(lambda: probe(sys.argv[1:]))

"""Multiple-choice evaluation: HellaSwag's jsonl, the plain form and llm.c's .bin read alike; bad items
refused by line; scores independent of batching and world size; the trainer logs eval/{name}/acc
alike on 1 and 3 ranks and evaluate.py --mc reports the same; transformers, given the exported
model and the same tokens, scores every choice alike (GPT-2 and Llama layouts)."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from fsdp_gpt.config import UserError
from conftest import ROOT, checkpoint_of, launch, launcher_once, scalars, shared, tool
from fsdp_gpt.data.tokenizer import get_tokenizer
from fsdp_gpt.evaluation.mc_eval import Item, accuracies, mc_sums, read_items, read_llmc, row, score_group, truncated
from fsdp_gpt.model import GPT, GPTConfig

sys.path.insert(0, os.path.join(ROOT, "bench"))
from mc_cost import write_items  # noqa: E402


def write_llmc(path, items: list[Item]) -> None:
    """llm.c's eval file, as its dev/data/data_common.py documents it."""
    stream = []
    for index, item in enumerate(items):
        example = [2**16 - 1, 0, index, item.label, len(item.choices), len(item.context), *item.context]
        for choice in item.choices:
            example += [len(choice), *choice]
        example[1] = 2 * len(example)
        stream += example
    header = np.zeros(256, dtype=np.int32)
    header[:4] = [20240522, 1, len(items), 0]
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.array(stream, dtype=np.uint16).tobytes())


def test_hellaswag_jsonl_the_plain_form_and_llmc_bin_read_as_the_same_items(tmp_path):
    write_items(tmp_path / "hellaswag.jsonl", 12, seed=1)
    records = [json.loads(line) for line in open(tmp_path / "hellaswag.jsonl")]
    with open(tmp_path / "plain.jsonl", "w") as f:
        for i, r in enumerate(records):  # labels as the Hugging Face copy stores them, now and then
            label = str(r["label"]) if i % 2 else r["label"]
            f.write(json.dumps({"context": r["ctx"], "choices": r["endings"], "label": label}) + "\n\n")
    items = read_items(str(tmp_path / "hellaswag.jsonl"), "bytes")
    assert len(items) == 12 and [item.label for item in items] == [r["label"] for r in records]
    first = records[0]
    assert items[0].context == list(first["ctx"].encode()) and items[0].choices[1] == list(f" {first['endings'][1]}".encode())
    assert read_items(str(tmp_path / "plain.jsonl"), "bytes") == items
    write_llmc(tmp_path / "hellaswag_val.bin", items)
    assert read_llmc(str(tmp_path / "hellaswag_val.bin")) == items
    with pytest.raises(UserError, match="holds GPT-2 tokens .* the model reads 'bytes' tokens"):
        read_items(str(tmp_path / "hellaswag_val.bin"), "bytes")


GOOD = {"ctx": "a = 1", "endings": ["b = 2", "c = 3", "d = 4", "e = 5"], "label": 2}


@pytest.mark.parametrize("bad, message", [
    ({"label": 4}, "'label' must be the index of the right choice, 0 to 3, got 4"),
    ({"label": "two"}, "got 'two'"),
    ({"label": None}, "got None"),
    ({"label": True}, "got True"),
    ({"endings": None}, "'endings' must be a list of two or more non-empty strings"),
    ({"endings": ["x", ""]}, "'endings' must be a list"),
    ({"ctx": ""}, "'ctx' must be a non-empty string"),
    ({"ctx": None, "context": "x"}, "'choices' must be a list of two or more non-empty strings"),  # forms mixed
    ("not json", "not JSON"),
    ({"ctx": None, "endings": None, "question": "?"}, "no 'ctx' and 'endings' (HellaSwag) nor 'context' and 'choices' fields"),
])
def test_a_bad_item_is_refused_naming_its_line(bad, message, tmp_path):
    line = bad if isinstance(bad, str) else json.dumps({k: v for k, v in (GOOD | bad).items() if v is not None or k == "label"})
    (tmp_path / "items.jsonl").write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(UserError) as refused:
        read_items(str(tmp_path / "items.jsonl"), "bytes")
    assert str(refused.value).startswith(f"{tmp_path}/items.jsonl line 3: ") and message in str(refused.value)


def test_a_damaged_llmc_file_is_refused(tmp_path):
    items = [Item([1, 2], [[3], [4, 5]], 1)] * 3
    write_llmc(tmp_path / "ok.bin", items)
    data = (tmp_path / "ok.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-4])
    with pytest.raises(UserError, match="short.bin example 2: its lengths don't add up"):
        read_llmc(str(tmp_path / "short.bin"))
    (tmp_path / "other.bin").write_bytes(np.array([20240520, 1], dtype=np.int32).tobytes() + data[8:])
    with pytest.raises(UserError, match="other.bin is not an llm.c eval file \\(header 20240520"):
        read_llmc(str(tmp_path / "other.bin"))


def test_rows_lose_the_start_of_their_context():
    item = Item(context=list(range(10)), choices=[[20, 21, 22], list(range(30, 42))], label=0)
    assert row(item, item.choices[0], block_size=8) == ([4, 5, 6, 7, 8, 9, 20, 21, 22], 3)
    assert row(item, item.choices[0], block_size=20) == (list(range(10)) + [20, 21, 22], 3)
    assert row(item, item.choices[1], block_size=8) == (list(range(33, 42)), 8)  # the choice itself cut
    assert truncated([item], 20) == 1 and truncated([item], 21) == 0


def random_items(n: int, vocab: int, seed: int) -> list[Item]:
    g = torch.Generator().manual_seed(seed)
    def tokens(low, high):
        return torch.randint(0, vocab, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
    return [Item(tokens(1, 20), [tokens(1, 8) for _ in range(int(torch.randint(2, 5, (1,), generator=g)))],
                 int(torch.randint(0, 2, (1,), generator=g))) for _ in range(n)]


def test_scores_do_not_depend_on_the_batching_and_shares_add_up_to_one_process():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    items = random_items(23, 64, seed=3)
    one_by_one = [score_group(model, [item], 16, torch.device("cpu"))[0] for item in items]
    batched = score_group(model, items, 16, torch.device("cpu"))
    for alone, together in zip(one_by_one, batched):
        assert torch.allclose(alone, together, rtol=1e-5, atol=1e-5)
    whole = mc_sums(model, items, 16, 5, 0, 1, torch.device("cpu"))
    shares = sum(mc_sums(model, items, 16, 5, rank, 3, torch.device("cpu")) for rank in range(3))
    assert torch.equal(whole, shares) and whole[2] == 23
    right = [(s.argmax(0) == item.label).tolist() for s, item in zip(one_by_one, items)]
    assert accuracies(whole) == {"acc": sum(r[0] for r in right) / 23, "acc_norm": sum(r[1] for r in right) / 23}


# ---- the trainer and the tools ----
MC_RUNS = {  # name: (ranks, settings); block_size 32 cuts most items' contexts
    "gpt2": (1, dict(checkpoint_type="full")),
    "gpt2_3": (3, dict(checkpoint_type="sharded")),
    "llama": (2, dict(arch="llama", n_kv_head=1, qk_norm=True, checkpoint_type="sharded")),
}


def write_test_items(path: str) -> None:
    """36 items whose rows block_size 32 cuts, then 4 it doesn't."""
    write_items(path, 36)
    with open(path, "a") as f:
        for label in range(4):
            f.write(json.dumps({"ctx": f"x = {label}", "endings": ["y = 1", "x += 1", "del x", "pass"], "label": label}) + "\n")


@pytest.fixture(scope="module")
def mc_runs(corpus, tmp_path_factory):
    items = os.path.join(shared(tmp_path_factory, "mc_items", lambda folder: write_test_items(f"{folder}/items.jsonl")),
                         "items.jsonl")
    run = launcher_once(tmp_path_factory, "mc", train_batch=12, micro_batch=2, max_iters=4, eval_interval=2,
                        save_interval=4, mc_eval_path=items, **corpus)
    return items, lambda name: run(name, MC_RUNS[name][0], **MC_RUNS[name][1])


@pytest.mark.slow
def test_the_trainer_logs_the_same_accuracy_on_any_world_size(mc_runs):
    _, run = mc_runs
    one, three = run("gpt2"), run("gpt2_3")
    for metric in ("acc", "acc_norm"):
        logged = scalars(os.path.join(one, "tb"), f"eval/items/{metric}")
        assert sorted(logged) == [0, 2, 4] and logged == scalars(os.path.join(three, "tb"), f"eval/items/{metric}")
    out = open(os.path.join(one, "stdout.txt")).read()
    assert "note: 36 of 40 items of items are longer than block_size 32" in out
    assert "step 4/4 | val loss" in out and f"| items acc {logged[4]:.4f}" in out


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("gpt2", "full"), ("llama", "sharded")])
def test_evaluate_py_reports_what_the_run_logged(name, kind, mc_runs):
    items, run = mc_runs
    out = tool("evaluate.py", checkpoint_of(run(name), kind, 4), "--mc", items)
    logged = {m: scalars(os.path.join(run(name), "tb"), f"eval/items/{m}")[4] for m in ("acc", "acc_norm")}
    assert f"| items | acc {logged['acc']:.4f} | acc_norm {logged['acc_norm']:.4f} | 40 items, 36 truncated" in out


@pytest.mark.slow
def test_a_bad_item_stops_evaluate_py_with_one_line(mc_runs, tmp_path):
    _, run = mc_runs
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD | {"label": 7}) + "\n")
    result = launch([os.path.join(ROOT, "evaluate.py"), checkpoint_of(run("gpt2"), "full", 4), "--mc",
                     str(tmp_path / "bad.jsonl")], ROOT)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {tmp_path}/bad.jsonl line 1: 'label' must be the index of the right choice, 0 to 3, got 7"]


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("gpt2", "full"), ("llama", "sharded")])
def test_transformers_scores_every_choice_of_the_exported_model_alike(name, kind, mc_runs, tmp_path):
    """An independent computation: each row through transformers alone, no padding, no batching."""
    from transformers import AutoModelForCausalLM

    from fsdp_gpt.checkpoint.ckpt_format import load_gpt
    items_path, run = mc_runs
    checkpoint = checkpoint_of(run(name), kind, 4)
    tool("export_hf.py", checkpoint, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_gpt(checkpoint, torch.device("cpu"))
    items = read_items(items_path, "bytes")
    scores = score_group(ours, items, 32, torch.device("cpu"))
    encode = get_tokenizer("bytes").encode_ordinary
    for record, item, got in zip(map(json.loads, open(items_path)), items, scores):
        expected = []
        for ending in record["endings"]:
            context, choice = encode(record["ctx"]), encode(" " + ending)
            tokens = (context + choice)[-33:]  # what fits: block_size + 1
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens[:-1]])).logits[0].double(), -1)
            per_token = logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
            mine = per_token[-min(len(choice), len(tokens) - 1):]
            expected.append([mine.sum().item(), mine.mean().item()])
        expected = torch.tensor(expected, dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=0, atol=1e-4), (got - expected).abs().max()
        assert torch.equal(got.argmax(0), expected.argmax(0))

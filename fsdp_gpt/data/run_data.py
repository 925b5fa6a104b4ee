"""The data side of a training run: the vocabulary it settles on and its batch loader at a step
(which keeps the data's state in checkpoints: BatchLoader.state, load)."""
from fsdp_gpt.config import UserError
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.data.mixture import resumed_segment
from fsdp_gpt.data.tokenizer import check_data_tokenizer, get_tokenizer, is_hf_tokenizer
from fsdp_gpt.distributed.context_parallel import row_pieces
from fsdp_gpt.distributed.launch import Topology, agree


def settle_data(cfg, sources: dict, topo: Topology):
    """Check the prepared data against the config and settle what follows from it: the tokenizer
    (the data's own), the vocabulary, doc_mask's separator. Returns the tokenizer for text samples,
    or None."""
    data_path, meta = next(iter(sources.values()))
    agree(lambda: check_data_tokenizer(cfg.tokenizer, meta, data_path))  # a Hugging Face one: the data's own
    if topo.is_main and meta["tokenizer"] != cfg.tokenizer and not is_hf_tokenizer(cfg.tokenizer):
        print(f"note: the data was prepared with tokenizer '{meta['tokenizer']}', which is used instead of "
              f"the configured '{cfg.tokenizer}'", flush=True)
    cfg.tokenizer = meta["tokenizer"]  # what the data holds: sampling and export decode with it
    if cfg.doc_mask and meta.get("eot_token") is None:  # before the model is built and resumed
        raise UserError(f"doc_mask needs the token that separates documents, which {data_path}/meta.json does not name "
                        f"(nanoGPT's raw .bin files): prepare the data with data.py, or set doc_mask: false")
    return resolve_vocabulary(cfg, meta, topo)


def resolve_vocabulary(cfg, meta: dict, topo: Topology):
    """Set cfg.vocab_size from the config, the data or the tokenizer; return the tokenizer for
    text samples, or None. Pre-tokenized data trains without the tokenizer's file (gpt2's needs a
    download): only text samples need it, and without it they are skipped with a note."""
    data_vocab = meta.get("vocab_size")
    tokenizer = None
    if cfg.sample_tokens or (data_vocab is None and cfg.vocab_size is None):
        try:
            tokenizer = agree(lambda: get_tokenizer(cfg.tokenizer))  # every rank decides alike
        except UserError as e:
            if data_vocab is None and cfg.vocab_size is None:
                raise
            if topo.is_main:
                print(f"note: no text samples at eval: {e}", flush=True)
            cfg.sample_tokens = 0
    data_vocab = data_vocab or (tokenizer.n_vocab if tokenizer else cfg.vocab_size)
    if cfg.vocab_size is None:
        cfg.vocab_size = -(-data_vocab // 64) * 64  # a multiple of 64: faster matmuls
    if cfg.vocab_size < data_vocab:
        raise UserError(f"vocab_size={cfg.vocab_size} is smaller than the data's {data_vocab} tokens")
    return tokenizer


def open_loader(cfg, sources: dict, topo: Topology, step: int) -> BatchLoader:
    """The batch loader of a run resumed after `step` (0: a fresh one). A mixture starts a segment of
    the configured weights there, until the checkpoint's state is loaded (BatchLoader.load)."""
    segment = None if cfg.data_mix is None else resumed_segment(list(cfg.data_mix), cfg.data_weights, None, step,
                                                                cfg.train_batch)[0]
    loader = BatchLoader(sources, cfg.block_size, cfg.train_batch, cfg.micro_batch, topo.dp_rank, topo.dp_size,
                         cfg.seed, topo.device, segment, cfg.align_rows,
                         row_pieces(cfg.cp_mode, topo.cp_rank, topo.cp_size, cfg.block_size), cfg.doc_mask, step)
    if topo.is_main and cfg.align_rows:
        cropped = ", ".join(f"{name} {share:.1%}" for name, share in loader.cropped().items())
        print(f"note: align_rows: rows start at documents; train tokens never read (cropped): {cropped}", flush=True)
    return loader

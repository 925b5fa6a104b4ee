"""The classes of the hybrid (and recurrent) models whose token mixers are not built here, refused by
name: transformers' layer_types call several of them linear_attention (Kimi Linear's KDA, Granite 4's
and Bamba's Mamba 2 alike), so a folder is told which layer it holds, not only that its class is not
among the families'. Plain Python, no torch."""

# what is built, as a refusal says it beside the classes of the families that have linear layers
BUILT_MIXERS = "attention, and Gated DeltaNet layers beside it as Qwen3.5 has them"
# {class: (config.json's model_type, what its layers hold that is not built)}
UNBUILT_CLASSES = {
    "KimiLinearForCausalLM": ("kimi_linear", "Kimi Delta Attention (KDA) layers (layer_types' linear_attention)"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "Mamba 2 layers (Granite 4's; layer_types' linear_attention)"),
    "BambaForCausalLM": ("bamba", "Mamba 2 layers (layer_types' linear_attention)"),
    "NemotronHForCausalLM": ("nemotron_h", "Mamba 2 layers (layers_block_type's mamba)"),
    "FalconH1ForCausalLM": ("falcon_h1", "a Mamba 2 mixer beside attention in every layer"),
    "Zamba2ForCausalLM": ("zamba2", "Mamba 2 layers and a shared attention block (layers_block_type)"),
    "ZambaForCausalLM": ("zamba", "Mamba layers and a shared attention block"),
    "JambaForCausalLM": ("jamba", "Mamba layers (attn_layer_period)"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba 2 layers alone"),
    "MambaForCausalLM": ("mamba", "Mamba layers alone"),
    "FalconMambaForCausalLM": ("falcon_mamba", "Mamba layers alone"),
    "Lfm2ForCausalLM": ("lfm2", "convolution-only blocks (layer_types' conv)"),
    "Lfm2MoeForCausalLM": ("lfm2_moe", "convolution-only blocks (layer_types' conv)"),
    "MiniMaxForCausalLM": ("minimax", "lightning attention layers (layer_types' linear_attention)"),
    "RecurrentGemmaForCausalLM": ("recurrent_gemma", "RG-LRU recurrent blocks (block_types' recurrent)"),
    "RwkvForCausalLM": ("rwkv", "RWKV time-mixing blocks"),
    "xLSTMForCausalLM": ("xlstm", "mLSTM blocks"),
    "OlmoHybridForCausalLM": ("olmo_hybrid", "OLMo Hybrid's Gated DeltaNet layers (separate q, k and v projections, "
                                             "beta up to 2 with linear_allow_neg_eigval: not Qwen3.5's layout)"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3-Next's Gated DeltaNet layers (q, k, v and z fused per key head in "
                                           "in_proj_qkvz: not Qwen3.5's layout)"),
}

"""Published model sizes as Hugging Face config fields, written here so nothing is downloaded.

Values are those of the models' published config.json files: Meta's Llama 2, Llama 3, Llama 3.1
and Llama 3.2; Mistral-7B-v0.3; Qwen2.5 0.5B, 1.5B and 7B; Qwen3 4B and 8B; Gemma 2 2B and 9B;
Phi-3-mini (4k). ``max_position_embeddings`` is the context the model was trained to (the fit says
where a length passes it): 8192 for Llama 3, 131072 for Llama 3.1 and 3.2 (rope scaled from 8192,
``rope_type`` "llama3"), 40960 for Qwen3 (whose card gives 32,768 tokens natively, 131,072 with
YaRN).
Only what sets memory matters here (widths, depth, heads, vocabulary, tied embeddings, the
attention's kind per layer); the rest is there so that transformers builds the same modules.
"""

_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_theta=1000000.0, hidden_act="silu", head_dim=128, attention_bias=False,
              use_sliding_window=False, sliding_window=None)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
               rope_theta=1000000.0, hidden_act="silu", use_sliding_window=False, tie_word_embeddings=True)
_GEMMA2 = dict(model_type="gemma2", vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6,
               rope_theta=10000.0, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
               tie_word_embeddings=True)

PRESETS = {
    "llama-2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3.1-8b": dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    # Llama 3.2's rope is scaled by 32 from 8192 to its 131072 tokens.
    "llama-3.2-1b": dict(_LLAMA31, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA31["rope_scaling"], factor=32.0)),
    "llama-3.2-3b": dict(_LLAMA31, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA31["rope_scaling"], factor=32.0)),
    # Mistral-7B-v0.3 (v0.1: vocabulary 32000, a 4096-token sliding window; the same widths).
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       rope_theta=1000000.0, sliding_window=None, hidden_act="silu", tie_word_embeddings=False,
                       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, max_position_embeddings=131072, tie_word_embeddings=False,
                       hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "gemma-2-2b": dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4),
    "gemma-2-9b": dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8),
    # Phi-3-mini-4k: fused qkv_proj and gate_up_proj.
    "phi-3-mini": dict(model_type="phi3", vocab_size=32064, max_position_embeddings=4096,
                       original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=2047, hidden_act="silu", tie_word_embeddings=False, pad_token_id=32000,
                       hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32),
}

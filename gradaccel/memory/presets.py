"""Published Llama sizes as Hugging Face config fields, written here so nothing is downloaded.

Values are those of the models' published config.json files (Meta's Llama 2 and Llama 3 cards).
"""

_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")

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
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
}

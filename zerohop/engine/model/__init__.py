"""The Llama-family decoder and its parts: attention over the paged cache, rotary embeddings,
linear layers (dense and block-quantized), fused kernels, and the runner of one forward pass.
"""

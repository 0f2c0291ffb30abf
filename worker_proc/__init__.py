"""The worker process: model weights, KV cache tensors, ragged batch building, attention, sampling."""

"""Talking to vLLM: the in-process engine, its worker extension and in-place weights, the `vllm serve`
server, the producer that keeps servers busy, and the weight transports to them."""

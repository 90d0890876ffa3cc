"""Served engines as chat backends: vLLM, SGLang and llama.cpp's server over the
OpenAI-compatible API (`session.RemoteSession`), their speculative-decoding figures
read from each server's metrics endpoint or per-request timings (`scrape`)."""

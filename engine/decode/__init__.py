"""The decode core: what a token passes through. Sampling, the speculative round
(`speculative.py`), the drafters, the controller and `ChatSession`."""

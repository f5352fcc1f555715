"""Token ids and text, wherever generation is consumed: decoding the LLM's ids into text and log probabilities
(`detokenize`) and the grammars that guide decoding (`guides`), shared by the reference runtime, the serving stages,
the gRPC client and the gateway."""

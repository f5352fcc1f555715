"""The Python decoders of PyNvVideoCodec 2.2.4 (decoders/__init__.py is empty upstream)."""

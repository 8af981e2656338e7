"""Fixtures shared by the tests, benchmarks and demos: deterministic local models
(:mod:`cxlkv.testing.models`). Not part of the library's API; imports none of cxlkv."""

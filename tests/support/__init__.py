"""Fakes, harnesses and servers the tests share (no tests here)."""

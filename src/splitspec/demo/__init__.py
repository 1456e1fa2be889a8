"""The demo pair: a small Kimi-K2 target and its EAGLE-3 drafter, trained here or written with random weights.

Only the CLI and the tests import this package. Inside it, :mod:`splitspec.demo.pair` drives the others;
:mod:`splitspec.demo.checkpoints` (the published formats, the random pair) imports no training code.
"""

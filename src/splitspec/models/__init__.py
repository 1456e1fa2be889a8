"""Engine-side model forwards: the Kimi-K2 target (MLA + MoE) and the EAGLE-3 drafter."""

"""Tiny VLA policies with flow-matching (SDE / learned-noise / ODE-SDE mix log-probs) and discrete-bin heads."""
from .flow_head import MODES, FlowActionHead, FlowSample, sigma_schedule
from .vla import TinyVLA, VLAConfig, tokenize

__all__ = ["MODES", "FlowActionHead", "FlowSample", "sigma_schedule", "TinyVLA", "VLAConfig", "tokenize"]

"""World models as simulators for VLA post-training (WoVR, VLA-RFT, WMPO, World-Env): model, env, rewards, audit."""

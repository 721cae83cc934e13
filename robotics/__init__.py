"""grove robotics: VLA policies post-trained with group-relative RL in Meta-World (MuJoCo).

MuJoCo picks its OpenGL backend when it is first imported, so the headless EGL default is set here, before any
submodule can import ``mujoco`` (an explicit ``MUJOCO_GL`` from the user wins). This is the only place: Python
runs it before any ``robotics.*`` module (also in spawned env workers), and ``shared_rl`` (the ``grove`` CLI)
never imports robotics and leaves these variables alone.
"""
import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"] if os.environ["MUJOCO_GL"] in ("egl", "osmesa") else "")
if not os.environ["PYOPENGL_PLATFORM"]:
    del os.environ["PYOPENGL_PLATFORM"]

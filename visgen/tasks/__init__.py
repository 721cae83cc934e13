"""The visgen tasks (``visgen.tasks.base``: the registry). Importing this package registers every task: the
embedded ``shapes``, ``words`` and ``video_shapes`` (prompts, renderer, analytic checker or OCR, pretraining data)
and ``file`` (prompt files)."""
from . import files, shapes, video, words  # noqa: F401  (each registers its task)
from .base import TASKS, EmbeddedTask, ImageTask, PretrainConfig, Prompts, Task, get_task, register_task

__all__ = ["TASKS", "Task", "EmbeddedTask", "ImageTask", "PretrainConfig", "Prompts", "get_task", "register_task"]

"""Browser envs: MiniWoB++ tasks in a headless Chromium (``miniwob``)."""

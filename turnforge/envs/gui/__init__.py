"""GUI envs seen as screenshots: ``gui-click``, grounding on synthetic screens or MiniWoB pages (``click``)."""

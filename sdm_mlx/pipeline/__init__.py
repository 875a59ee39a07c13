"""Recipes of the real-LLM experiments: their data (:mod:`.task_data`) and the stages that run them."""

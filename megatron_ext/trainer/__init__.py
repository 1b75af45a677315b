"""The suite's main job (``scripts/pretrain_gpt.py``): flags (:mod:`.cli`), set-up steps
(:mod:`.components`), the loop (:mod:`.loop`) and the entry point (:mod:`.main`). It sits above
the plugins: it imports them, none imports it."""

"""What every plugin of the suite may import: the owner of process-wide changes
(:mod:`.installer`). Nothing here imports a plugin."""

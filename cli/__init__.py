"""The mlx-stream command line (Typer). Imports the engine lazily, inside commands."""

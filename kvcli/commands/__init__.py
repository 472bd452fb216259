"""The commands that live in their own files; kvcli/cli.py registers them on the app."""

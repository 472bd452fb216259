"""The commands, a file each (kvcli/cli.py registers them on the app); common.py holds what they share."""

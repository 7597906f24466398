"""The `specgov` command line: click commands, output formatting, the control client, the demo."""

"""(placeholder: being written)"""

COMMANDS: dict = {}

"""Operator tools: rollouts through ansible-runner, status, reports, smoke and perf gate, wheelhouses."""

#!/usr/bin/env bash
# Removes every emulated host and the switch (what up.sh made); safe to run at any time.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^fvhost([0-9]+|sw)$'); do
  ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$ns" 2>/dev/null
done
true

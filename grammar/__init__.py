"""The .splan grammar, shipped inside the wheel as shardplan.grammar."""

"""The RoPE-commuting pair rotations against no rotation: damage summed over layers on the held-out
and on the calibration capture (option S4/R32), and held out when each layer takes the pair
rotation only where the calibration capture says it is better (what a calibrator offering both
would choose).

Usage: python summarize_pairs.py HELDOUT.csv INSAMPLE.csv
"""
import sys

import pandas as pd


def table(path):
    d = pd.read_csv(path, comment="#")
    return d[d.option == "S4/R32/post"].pivot_table(index="layer", columns=["variant", "bits"], values="damage")


held, ins = table(sys.argv[1]), table(sys.argv[2])
print("variant,bits,held_out,calibration,layers_pair_chosen,held_out_chosen,change")
for plain, pair in (("pre/id/q", "pre/pair/q"), ("pre/id/q/012348", "pre/pair/q/012348")):
    for b in sorted({b for _, b in held.columns}):
        take = ins[(pair, b)] < ins[(plain, b)]
        chosen = held[(pair, b)].where(take, held[(plain, b)]).sum()
        for v in (plain, pair):
            print(f"{v},{b},{held[(v, b)].sum():.4g},{ins[(v, b)].sum():.4g},,,")
        print(f"{plain}+pair,{b},,,{int(take.sum())},{chosen:.4g},{chosen / held[(plain, b)].sum() - 1:+.1%}")

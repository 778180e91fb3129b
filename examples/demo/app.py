import sys

import pandas as pd

orders = pd.read_csv("data/orders.csv")
print(f"{sys.argv[1]}: {orders.amount.sum()} units in {len(orders)} orders")

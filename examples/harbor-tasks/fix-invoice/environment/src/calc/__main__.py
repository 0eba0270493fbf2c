import sys

from calc import totals

for invoice, total in sorted(totals(sys.argv[1]).items()):
    print(invoice, total)

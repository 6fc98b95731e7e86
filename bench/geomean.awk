# bench/geomean.awk: column c (-v c=N) of the input, one round a line (a ratio or a rate, > 0):
# its median, its geometric mean and the 95% Student t interval of that mean over the logs, as
# "median geomean lo hi". With -v fmt=table: "median, geomean [lo, hi]". Used by bench/batch.sh and
# bench/kvcd-paired.sh.
BEGIN {
        split("12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.160 2.145 2.131 " \
              "2.120 2.110 2.101 2.093 2.086 2.080 2.074 2.069 2.064 2.060 2.056 2.052 2.048 2.045 2.042", t, " ")
}
{ v[NR] = $c; l[NR] = log($c); s += l[NR] }
END {
        n = NR; m = s / n
        for (i = 1; i <= n; i++) ss += (l[i] - m) ^ 2
        se = n > 1 ? sqrt(ss / (n - 1) / n) : 0
        q = n - 1 <= 30 ? t[n - 1] : 1.96
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { x = v[i]; v[i] = v[j]; v[j] = x }
        med = n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
        if (fmt == "table")
                printf "%.3f, %.3f [%.3f, %.3f]", med, exp(m), exp(m - q * se), exp(m + q * se)
        else
                printf "%.3f %.3f %.3f %.3f\n", med, exp(m), exp(m - q * se), exp(m + q * se)
}

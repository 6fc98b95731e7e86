build/obj/kernels/summary.o: kernels/summary.c kernels/summary.h
kernels/summary.h:

build/obj/kernels/attention.o: kernels/attention.c kernels/attention.h \
 kernels/block.h
kernels/attention.h:
kernels/block.h:

build/obj/kernels/compact.o: kernels/compact.c kernels/compact.h \
 kernels/block.h
kernels/compact.h:
kernels/block.h:

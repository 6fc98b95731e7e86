build/obj/daemon/policy/basic.o: daemon/policy/basic.c \
 daemon/policy/policy.h
daemon/policy/policy.h:

build/obj/daemon/log.o: daemon/log.c daemon/log.h
daemon/log.h:
